//! RoPE frequencies: plain (`θ^(-2i/dim)`) and YaRN-corrected (frequency interpolation only — DeepSeek V4 uses no
//! mscale, so cos/sin are never scaled).
//!
//! Rope acts on the LAST `rope_dim` values of a vector, in interleaved pairs `(2i, 2i+1)` with angle
//! `pos · inv_freq[i]`. Angles are formed in f32 as the reference does (`pos as f32 * inv_freq`), then cos/sin.

use crate::model::config::RopeParams;

/// Inverse frequencies of one rope flavour (`rope_dim / 2` entries, f32 like the reference).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    pub inv_freq: Vec<f32>,
}

impl RopeFreqs {
    /// Frequencies for `rope_dim` rotated dims.
    pub fn new(p: &RopeParams, rope_dim: usize) -> RopeFreqs {
        let dim = rope_dim as f64;
        let half = rope_dim / 2;
        // base^(2i/dim) evaluated in f32, as torch does for `base ** (arange(0, dim, 2).float() / dim)`.
        let pos_freq: Vec<f32> = (0..half).map(|i| (p.base as f32).powf((2 * i) as f32 / dim as f32)).collect();
        let inv_freq = match p.yarn {
            None => pos_freq.iter().map(|&f| 1.0 / f).collect(),
            Some((factor, orig, beta_fast, beta_slow)) => {
                let corr = |rot: f64| (dim * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * p.base.ln());
                let low = corr(beta_fast).floor().max(0.0);
                let high = corr(beta_slow).ceil().min(dim - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                (0..half)
                    .map(|i| {
                        let ramp = (((i as f32) - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extrap = 1.0 - ramp;
                        let inv_extra = 1.0 / pos_freq[i];
                        let inv_inter = 1.0 / (factor as f32 * pos_freq[i]);
                        inv_inter * (1.0 - extrap) + inv_extra * extrap
                    })
                    .collect()
            }
        };
        RopeFreqs { inv_freq }
    }

    /// Rotates the last `2 * inv_freq.len()` values of `x` by `pos` (or by `-pos` when `inverse`).
    pub fn apply(&self, x: &mut [f32], pos: usize, inverse: bool) {
        let rd = self.inv_freq.len() * 2;
        let n = x.len();
        let r = &mut x[n - rd..];
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let ang = pos as f32 * f;
            let (s, c) = ang.sin_cos();
            let s = if inverse { -s } else { s };
            let (a, b) = (r[2 * i], r[2 * i + 1]);
            r[2 * i] = a * c - b * s;
            r[2 * i + 1] = b * c + a * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_frequencies() {
        let f = RopeFreqs::new(&RopeParams { base: 10000.0, yarn: None }, 8);
        assert_eq!(f.inv_freq.len(), 4);
        assert!((f.inv_freq[0] - 1.0).abs() < 1e-7);
        assert!((f.inv_freq[1] - 0.1).abs() < 1e-7);
        assert!((f.inv_freq[3] - 1e-3).abs() < 1e-9);
    }

    #[test]
    fn yarn_keeps_fast_dims_and_scales_slow_dims() {
        // dim 64, orig 32, base 160000: low = floor(64 ln(32/(64π)) / (2 ln 160000)) < 0 -> 0,
        // high = ceil(64 ln(32/(2π)) / (2 ln 160000)) = ceil(4.339...) = 5.
        let p = RopeParams { base: 160000.0, yarn: Some((16.0, 32.0, 32.0, 1.0)) };
        let y = RopeFreqs::new(&p, 64);
        let plain = RopeFreqs::new(&RopeParams { base: 160000.0, yarn: None }, 64);
        assert_eq!(y.inv_freq[0], plain.inv_freq[0]);
        for i in 5..32 {
            assert!((y.inv_freq[i] - plain.inv_freq[i] / 16.0).abs() <= 1e-6 * plain.inv_freq[i]);
        }
        // Ramp in between: i = 2 is 2/5 of the way to interpolation.
        let want = plain.inv_freq[2] * (1.0 - 0.4) + plain.inv_freq[2] / 16.0 * 0.4;
        assert!((y.inv_freq[2] - want).abs() < 1e-6);
    }

    #[test]
    fn inverse_undoes_rotation() {
        let f = RopeFreqs::new(&RopeParams { base: 10000.0, yarn: None }, 4);
        let orig = [1.0f32, 2.0, 3.0, -1.0, 0.5, 0.25];
        let mut x = orig;
        f.apply(&mut x, 7, false);
        assert_eq!(&x[..2], &orig[..2]);
        assert!((x[2] - (3.0 * 7f32.cos() + 1.0 * 7f32.sin())).abs() < 1e-5);
        f.apply(&mut x, 7, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
