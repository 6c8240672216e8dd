//! Scale searches shared by the quantizers (the idea of ggml's `make_qx_quants` / `make_qkx2_quants`, written from
//! scratch): try a handful of candidate scales, round every value to the nearest level for each, refit the scale
//! (and min) by weighted least squares on those levels, and keep the candidate with the least weighted squared
//! error `Σ w (x̂ - x)²`.
//!
//! Weights are per value and non-negative; callers derive them from the data (e.g. `|x|`) or from an importance
//! matrix. Inputs are assumed finite (the public API rejects NaN/inf before quantizing). Nothing here panics as
//! long as `x`, `w` and the level buffer have equal lengths (callers pass fixed-size sub-blocks).

/// The nearest integer, ties away from zero, as i32 (saturating for huge values).
#[inline(always)]
pub(crate) fn nearest(v: f32) -> i32 {
    v.round() as i32
}

/// Per-value weights for a scale search.
#[derive(Clone, Copy)]
pub(crate) enum Weighting<'a> {
    /// All values count the same.
    #[allow(dead_code)]
    Uniform,
    /// One non-negative weight per value.
    Importance(&'a [f32]),
}

impl Weighting<'_> {
    #[inline(always)]
    fn at(&self, i: usize) -> f32 {
        match self {
            Weighting::Uniform => 1.0,
            Weighting::Importance(w) => w[i],
        }
    }
}

/// Symmetric levels `q ∈ [-nmax, nmax]`, `x ≈ d·q`. Returns `d` (0 for an all-zero input) and fills `q`.
pub(crate) fn symmetric_scale(x: &[f32], w: Weighting<'_>, nmax: i32, q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let mut best_score = -1f32;
    let mut best_iscale = nmax as f32 / amax;
    let mut best_d = amax / nmax as f32;
    for step in -9..=9 {
        let iscale = (nmax as f32 + 0.1 * step as f32) / amax;
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for (i, &v) in x.iter().enumerate() {
            let l = nearest(iscale * v).clamp(-nmax, nmax) as f32;
            let wi = w.at(i);
            sumlx += wi * v * l;
            suml2 += wi * l * l;
        }
        if suml2 > 0.0 {
            // Error = Σwx² - sumlx²/suml2 at the least-squares scale: maximise sumlx²/suml2.
            let score = sumlx * sumlx / suml2;
            if score > best_score {
                best_score = score;
                best_iscale = iscale;
                best_d = sumlx / suml2;
            }
        }
    }
    for (o, &v) in q.iter_mut().zip(x) {
        *o = nearest(best_iscale * v).clamp(-nmax, nmax) as i8;
    }
    best_d
}

/// Asymmetric levels `l ∈ [0, nmax]`, `x ≈ scale·l - min` with `min ≥ 0`. Returns `(scale, min)` and fills `l`.
///
/// Candidates: `nstep + 1` inverse scales `(nmax + rmin + rdelta·k) / (max - min)`; each refits scale and offset by
/// weighted least squares (clamping the offset to ≤ 0, i.e. `min ≥ 0`, as the formats store a non-negative min).
pub(crate) fn asymmetric_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    levels: &mut [u8],
) -> (f32, f32) {
    let n = x.len();
    let mut lo = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if lo > 0.0 {
        lo = 0.0;
    }
    if n == 0 || hi <= lo {
        levels.iter_mut().for_each(|l| *l = 0);
        return (0.0, -lo);
    }
    let (mut sum_w, mut sum_x) = (0f32, 0f32);
    for i in 0..n {
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    let err_of = |scale: f32, off: f32, ls: &[u8]| -> f32 {
        (0..n).map(|i| w[i] * (scale * ls[i] as f32 + off - x[i]).powi(2)).sum()
    };

    // Start: plain min/max mapping.
    let iscale = nmax as f32 / (hi - lo);
    let mut best_scale = 1.0 / iscale;
    let mut best_off = lo;
    for i in 0..n {
        levels[i] = nearest(iscale * (x[i] - lo)).clamp(0, nmax) as u8;
    }
    let mut best_err = err_of(best_scale, best_off, levels);

    let mut cand = [0u8; 256];
    let cand = &mut cand[..n.min(256)];
    if cand.len() < n {
        return (best_scale, -best_off);
    }
    for k in 0..=nstep {
        let iscale = (nmax as f32 + rmin + rdelta * k as f32) / (hi - lo);
        let (mut sl, mut sl2, mut sxl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest(iscale * (x[i] - lo)).clamp(0, nmax) as u8;
            cand[i] = l;
            let lf = l as f32;
            sl += w[i] * lf;
            sl2 += w[i] * lf * lf;
            sxl += w[i] * lf * x[i];
        }
        let det = sum_w * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut scale = (sum_w * sxl - sum_x * sl) / det;
        let mut off = (sl2 * sum_x - sl * sxl) / det;
        if off > 0.0 {
            off = 0.0;
            if sl2 <= 0.0 {
                continue;
            }
            scale = sxl / sl2;
        }
        let e = err_of(scale, off, cand);
        if e < best_err {
            best_err = e;
            best_scale = scale;
            best_off = off;
            levels[..n].copy_from_slice(cand);
        }
    }
    (best_scale, -best_off)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symmetric_scale_is_exact_on_a_lattice() {
        let x: Vec<f32> = (-7..=7).map(|i| i as f32 * 0.5).collect();
        let mut q = vec![0i8; x.len()];
        let d = symmetric_scale(&x, Weighting::Uniform, 7, &mut q);
        for (v, l) in x.iter().zip(&q) {
            assert!((d * *l as f32 - v).abs() < 1e-6);
        }
    }

    #[test]
    fn asymmetric_fit_recovers_an_offset_lattice() {
        let x: Vec<f32> = (0..16).map(|i| (i % 4) as f32 * 0.3 - 0.2).collect();
        let w = vec![1f32; 16];
        let mut l = vec![0u8; 16];
        let (s, m) = asymmetric_scale_min(&x, &w, 3, -0.5, 0.1, 15, &mut l);
        for (v, q) in x.iter().zip(&l) {
            assert!((s * *q as f32 - m - v).abs() < 1e-5, "{s} {m} {q} {v}");
        }
    }

    #[test]
    fn constant_negative_input_is_all_min() {
        let mut l = [9u8; 8];
        let (s, m) = asymmetric_scale_min(&[-0.5; 8], &[1.0; 8], 15, -1.0, 0.1, 20, &mut l);
        assert_eq!(s, 0.0);
        assert_eq!(m, 0.5);
        assert!(l.iter().all(|&v| v == 0));
    }
}
