//! RMSNorm: `x · rsqrt(mean(x²) + eps)` (optionally `· w`). The mean is accumulated in f64 for stability; the
//! result is f32. Pure functions on slices; lengths must match (callers pass validated shapes).

/// `1 / sqrt(mean(x²) + eps)`. The f64 sum of squares runs in eight interleaved partial sums (element `i` into
/// sum `i mod 8`, combined pairwise at the end, then the tail in order): the same order for a row whatever the
/// batch, and vectorizable, where one running sum was a chain of dependent adds (most of the op's time).
#[inline]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += (v as f64) * (v as f64);
        }
    }
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    let mut ss = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7));
    for &v in tail {
        ss += (v as f64) * (v as f64);
    }
    let mean = (ss / x.len().max(1) as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `out = x · rsqrt(mean(x²)+eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let s = rms_scale(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * s);
    }
}

/// In-place weighted RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let s = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * s);
    }
}

/// In-place unweighted RMSNorm.
pub fn rms_norm_unweighted(x: &mut [f32], eps: f32) {
    let s = rms_scale(x, eps);
    x.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_values() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut o);
        let s = 1.0 / (12.5f32).sqrt();
        assert!((o[0] - 3.0 * s).abs() < 1e-6 && (o[1] - 8.0 * s).abs() < 1e-6);
        let mut y = [0f32; 3];
        rms_norm_unweighted(&mut y, 1e-6);
        assert_eq!(y, [0.0; 3]);
    }
}
