//! Token sampling on the scheduler thread: greedy at temperature 0, otherwise temperature + top-k + top-p with a
//! per-request seeded RNG (same seed → same tokens).
//!
//! Invariant: `sample` never panics on any logits slice (NaN logits are treated as -inf; an empty slice yields 0).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling knobs shared by every API (already validated by the API layer).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: None }
    }
}

/// A sampler for one request.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler { params, rng }
    }

    /// Pick the next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
        if logits.is_empty() {
            return 0;
        }
        let argmax = || {
            logits.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
                if clean(x) > best.1 {
                    (i, clean(x))
                } else {
                    best
                }
            })
        };
        if self.params.temperature <= 0.0 {
            return argmax().0 as u32;
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| clean(logits[b]).total_cmp(&clean(logits[a])));
        if self.params.top_k > 0 {
            idx.truncate(self.params.top_k);
        }
        let max = clean(logits[idx[0]]);
        if !max.is_finite() {
            return argmax().0 as u32;
        }
        let t = self.params.temperature;
        let mut probs: Vec<f32> = idx.iter().map(|&i| ((clean(logits[i]) - max) / t).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (n, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p {
                    keep = n + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.gen::<f32>() * total;
        for (n, p) in probs.iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return idx[n] as u32;
            }
        }
        idx[probs.len() - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_and_ignores_nan() {
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, ..Default::default() });
        assert_eq!(s.sample(&[0.1, f32::NAN, 3.0, 2.0]), 2);
        assert_eq!(s.sample(&[]), 0);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let mut s = Sampler::new(SamplingParams { temperature: 5.0, top_k: 1, ..Default::default() });
        assert_eq!(s.sample(&[0.0, 1.0, 0.5]), 1);
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.1).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() });
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_p_keeps_only_the_head() {
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() });
        for _ in 0..50 {
            assert_eq!(s.sample(&[10.0, 0.0, 0.0]), 0);
        }
    }
}
