//! RoPE frequencies: plain (`θ^(-2i/dim)`) and YaRN-corrected (frequency interpolation only — DeepSeek V4 uses no
//! mscale, so cos/sin are never scaled).
//!
//! Rope acts on the LAST `rope_dim` values of a vector, in interleaved pairs `(2i, 2i+1)` with angle
//! `pos · inv_freq[i]`. Angles are formed in f32 as the reference does (`pos as f32 * inv_freq`), then cos/sin.

use crate::model::config::RopeSpec;

/// Inverse frequencies of one rope flavour (`rope_dim / 2` entries, f32 like the reference).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    pub inv_freq: Vec<f32>,
}

impl RopeFreqs {
    /// Frequencies for `rope_dim` rotated dims.
    pub fn new(p: &RopeSpec, rope_dim: usize) -> RopeFreqs {
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
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let cs = Self::cos_sin(pos, f, inverse);
            Self::rotate_pair(x, self.inv_freq.len(), i, cs);
        }
    }

    /// `(cos, sin)` of every pair's angle at `pos` (the sine negated when `inverse`) into `out`
    /// (`inv_freq.len()` entries): what [`RopeFreqs::apply`] rotates by, so [`RopeFreqs::rotate`] with this table
    /// gives the same bits. Many vectors at one position (a row's heads) share one table: the sines and cosines
    /// are most of the cost of rotating.
    pub fn table(&self, pos: usize, inverse: bool, out: &mut [(f32, f32)]) {
        for (o, &f) in out.iter_mut().zip(&self.inv_freq) {
            *o = Self::cos_sin(pos, f, inverse);
        }
    }

    /// Rotates the last `2 * cs.len()` values of `x` by a [`RopeFreqs::table`].
    pub fn rotate(x: &mut [f32], cs: &[(f32, f32)]) {
        for (i, &c) in cs.iter().enumerate() {
            Self::rotate_pair(x, cs.len(), i, c);
        }
    }

    fn cos_sin(pos: usize, f: f32, inverse: bool) -> (f32, f32) {
        let (s, c) = (pos as f32 * f).sin_cos();
        (c, if inverse { -s } else { s })
    }

    /// Pair `i` of the last `2 · half` values of `x`.
    fn rotate_pair(x: &mut [f32], half: usize, i: usize, (c, s): (f32, f32)) {
        let n = x.len();
        let r = &mut x[n - 2 * half..];
        let (a, b) = (r[2 * i], r[2 * i + 1]);
        r[2 * i] = a * c - b * s;
        r[2 * i + 1] = b * c + a * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_frequencies() {
        let f = RopeFreqs::new(&RopeSpec { base: 10000.0, yarn: None }, 8);
        assert_eq!(f.inv_freq.len(), 4);
        assert!((f.inv_freq[0] - 1.0).abs() < 1e-7);
        assert!((f.inv_freq[1] - 0.1).abs() < 1e-7);
        assert!((f.inv_freq[3] - 1e-3).abs() < 1e-9);
    }

    #[test]
    fn yarn_keeps_fast_dims_and_scales_slow_dims() {
        // dim 64, orig 32, base 160000: low = floor(64 ln(32/(64π)) / (2 ln 160000)) < 0 -> 0,
        // high = ceil(64 ln(32/(2π)) / (2 ln 160000)) = ceil(4.339...) = 5.
        let p = RopeSpec { base: 160000.0, yarn: Some((16.0, 32.0, 32.0, 1.0)) };
        let y = RopeFreqs::new(&p, 64);
        let plain = RopeFreqs::new(&RopeSpec { base: 160000.0, yarn: None }, 64);
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
        let f = RopeFreqs::new(&RopeSpec { base: 10000.0, yarn: None }, 4);
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

    #[test]
    fn a_table_rotates_exactly_as_apply() {
        let f = RopeFreqs::new(&RopeSpec { base: 160000.0, yarn: Some((16.0, 65536.0, 32.0, 1.0)) }, 64);
        let x: Vec<f32> = (0..80).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
        let mut cs = vec![(0f32, 0f32); 32];
        for pos in [0usize, 1, 7, 4095, 1 << 20] {
            for inverse in [false, true] {
                let (mut a, mut b) = (x.clone(), x.clone());
                f.apply(&mut a, pos, inverse);
                f.table(pos, inverse, &mut cs);
                RopeFreqs::rotate(&mut b, &cs);
                assert_eq!(
                    a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                assert_eq!(a[..16], x[..16], "only the last 64 values rotate");
                if pos > 0 {
                    assert_ne!(a[16..], x[16..], "pos {pos} rotates");
                }
            }
        }
    }
}
