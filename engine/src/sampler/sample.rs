//! [`Sampler`]: one logits row → one token id. See the module doc of [`crate::sampler`] for the order of operations.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};

use super::rng::Rng;
use crate::grammar::TokenMask;
use crate::{Error, Result};

/// Sampling settings. `Default` is plain sampling at temperature 1 with every filter off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax). Must be finite and ≥ 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely ids; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely ids whose probability mass reaches `top_p`; 1 = off. In (0, 1].
    pub top_p: f32,
    /// Drop ids whose probability is below `min_p × p_max`; 0 = off. In [0, 1].
    pub min_p: f32,
    pub seed: u64,
    /// Values above 1 discourage ids seen in the last `penalty_last_n` accepted ids (positive logits divided,
    /// negative multiplied); 1 = off. Must be positive.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every id seen; 0 = off.
    pub presence_penalty: f32,
    /// Subtracted per occurrence; 0 = off.
    pub frequency_penalty: f32,
    /// How many recent accepted ids the penalties look at.
    pub penalty_last_n: usize,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 256,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplerConfig { temperature: 0.0, ..Default::default() }
    }

    /// Checks ranges; see the field docs.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be finite and >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("presence/frequency penalties must be finite".into());
        }
        Ok(())
    }
}

/// Index of the largest finite logit (the first one on ties); `None` if there is none.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() || x == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// The distribution sampling draws from (ids with probabilities summing to 1, most likely first), after
/// temperature, top-k, top-p and min-p. Temperature 0 gives the argmax with probability 1.
pub fn filtered_distribution(logits: &[f32], cfg: &SamplerConfig) -> Result<Vec<(u32, f64)>> {
    cfg.validate()?;
    let best = argmax(logits).ok_or_else(|| Error::InvalidArgument("logits row has no finite value".into()))?;
    if cfg.temperature == 0.0 {
        return Ok(vec![(best, 1.0)]);
    }
    let t = cfg.temperature as f64;
    let max = logits[best as usize] as f64;
    let mut cand: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, x)| x.is_finite() || **x == f32::INFINITY)
        .map(|(i, &x)| (i as u32, ((x as f64 - max) / t).exp()))
        .filter(|(_, w)| *w > 0.0 || w.is_nan())
        .map(|(i, w)| (i, if w.is_nan() { 1.0 } else { w }))
        .collect();
    // Most likely first; ties by id so the order is total and deterministic.
    let by_prob = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if cfg.top_k > 0 && cfg.top_k < cand.len() {
        cand.select_nth_unstable_by(cfg.top_k - 1, by_prob);
        cand.truncate(cfg.top_k);
    }
    cand.sort_unstable_by(by_prob);
    normalize(&mut cand);
    if cfg.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = cand.len();
        for (i, (_, p)) in cand.iter().enumerate() {
            acc += p;
            if acc >= cfg.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
        normalize(&mut cand);
    }
    if cfg.min_p > 0.0 {
        let cut = cfg.min_p as f64 * cand[0].1;
        cand.retain(|(_, p)| *p >= cut);
        normalize(&mut cand);
    }
    Ok(cand)
}

fn normalize(c: &mut [(u32, f64)]) {
    let s: f64 = c.iter().map(|x| x.1).sum();
    if s > 0.0 {
        for x in c.iter_mut() {
            x.1 /= s;
        }
    }
}

/// The outcome of [`Sampler::verify_drafted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The drafted id stands.
    Accept,
    /// The drafted id is rejected; this id takes its place (and the rest of the draft is dropped).
    Reject(u32),
}

/// Picks token ids; see the module doc. Holds the PRNG state and the penalty history of one generation.
#[derive(Clone, Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    structural: HashSet<u32>,
    history: VecDeque<u32>,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler seeded with `cfg.seed`. Errors on invalid settings.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        let rng = Rng::new(cfg.seed);
        Ok(Sampler { cfg, rng, structural: HashSet::new(), history: VecDeque::new(), counts: HashMap::new() })
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Ids that are taken greedily whenever they are the most likely id (e.g. `｜DSML｜`, `</think>`, EOS), so
    /// that tool-call markup stays well-formed at any temperature.
    pub fn set_structural_tokens(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.structural = ids.into_iter().collect();
    }

    /// Records an id that was appended to the sequence (for the penalties).
    pub fn accept(&mut self, id: u32) {
        if self.cfg.penalty_last_n == 0 {
            return;
        }
        self.history.push_back(id);
        *self.counts.entry(id).or_default() += 1;
        while self.history.len() > self.cfg.penalty_last_n {
            if let Some(old) = self.history.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
    }

    /// Picks the next id from a logits row.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        self.sample_with(logits, false)
    }

    /// Like [`Sampler::sample`]; `force_greedy` takes the argmax (e.g. while the output parser is inside DSML
    /// syntax, see `chat::StreamParser::in_tool_syntax`).
    pub fn sample_with(&mut self, logits: &[f32], force_greedy: bool) -> Result<u32> {
        let (logits, best) = self.penalized(logits)?;
        if force_greedy || self.cfg.temperature == 0.0 || self.structural.contains(&best) {
            return Ok(best);
        }
        let dist = filtered_distribution(&logits, &self.cfg)?;
        let u = self.rng.next_f64();
        let mut acc = 0.0;
        for &(id, p) in &dist {
            acc += p;
            if u < acc {
                return Ok(id);
            }
        }
        // Rounding left `acc` a hair below 1: the last candidate.
        Ok(dist.last().map(|x| x.0).unwrap_or(best))
    }

    /// Like [`Sampler::sample_with`], among the ids `mask` allows only (constrained decoding, see
    /// [`crate::grammar`]). When no allowed id has a finite logit the lowest allowed id is taken, so a grammar
    /// always makes progress; an empty mask is an error.
    pub fn sample_masked(&mut self, logits: &[f32], mask: &TokenMask, force_greedy: bool) -> Result<u32> {
        let mut masked = logits.to_vec();
        mask.apply(&mut masked);
        if argmax(&masked).is_none() {
            return mask.ids().next().ok_or_else(|| Error::InvalidArgument("the grammar allows no token here".into()));
        }
        self.sample_with(&masked, force_greedy)
    }

    /// The distribution [`Sampler::sample_with`]`(logits, false)` draws from, most likely first: penalties, then
    /// a point mass on the argmax at temperature 0 or when the argmax is a structural id, else
    /// [`filtered_distribution`].
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        let (logits, best) = self.penalized(logits)?;
        if self.cfg.temperature == 0.0 || self.structural.contains(&best) {
            return Ok(vec![(best, 1.0)]);
        }
        filtered_distribution(&logits, &self.cfg)
    }

    /// The logits with the penalties applied (borrowed when there are none) and their argmax.
    fn penalized<'a>(&self, logits: &'a [f32]) -> Result<(Cow<'a, [f32]>, u32)> {
        let logits: Cow<'a, [f32]> = if self.has_penalties() && !self.counts.is_empty() {
            Cow::Owned(self.penalize(logits))
        } else {
            Cow::Borrowed(logits)
        };
        let best = argmax(&logits).ok_or_else(|| Error::InvalidArgument("logits row has no finite value".into()))?;
        Ok((logits, best))
    }

    /// Speculative verification of one drafted id against the target's logits row at its position, for a
    /// deterministic drafter (its proposal has probability 1 under the draft distribution).
    ///
    /// With `p` the distribution [`Sampler::distribution`] gives for `logits`: `drafted` is accepted with
    /// probability `p(drafted)`; otherwise an id is drawn from `p` with `drafted` removed and renormalised. The id
    /// that comes out (the draft or the replacement) is distributed exactly as [`Sampler::sample`] would draw it:
    /// `P(x) = p(d)·[x = d] + (1 − p(d)) · p(x)·[x ≠ d] / (1 − p(d)) = p(x)`. At temperature 0 this is "accept
    /// while the argmax matches", and the replacement is the argmax. Neither id is recorded for the penalties:
    /// call [`Sampler::accept`] with the id that is appended.
    pub fn verify_drafted(&mut self, logits: &[f32], drafted: u32) -> Result<Verdict> {
        let dist = self.distribution(logits)?;
        let pd = dist.iter().find(|x| x.0 == drafted).map_or(0.0, |x| x.1);
        if pd >= 1.0 {
            return Ok(Verdict::Accept);
        }
        if pd > 0.0 && self.rng.next_f64() < pd {
            return Ok(Verdict::Accept);
        }
        // The residual: p without the drafted id (its mass 1 − p(d) > 0 since p(d) < 1).
        let rest = 1.0 - pd;
        let u = self.rng.next_f64() * rest;
        let mut acc = 0.0;
        let mut last = None;
        for &(id, p) in dist.iter().filter(|x| x.0 != drafted) {
            acc += p;
            last = Some(id);
            if u < acc {
                return Ok(Verdict::Reject(id));
            }
        }
        // Rounding left `acc` a hair below `rest`: the last candidate.
        last.map(Verdict::Reject).ok_or_else(|| Error::InvalidArgument("no id besides the drafted one".into()))
    }

    fn has_penalties(&self) -> bool {
        self.cfg.repetition_penalty != 1.0 || self.cfg.presence_penalty != 0.0 || self.cfg.frequency_penalty != 0.0
    }

    fn penalize(&self, logits: &[f32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        for (&id, &n) in &self.counts {
            if let Some(x) = out.get_mut(id as usize) {
                if self.cfg.repetition_penalty != 1.0 {
                    *x = if *x > 0.0 { *x / self.cfg.repetition_penalty } else { *x * self.cfg.repetition_penalty };
                }
                *x -= self.cfg.presence_penalty + self.cfg.frequency_penalty * n as f32;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32) -> SamplerConfig {
        SamplerConfig { temperature, seed: 1234, ..Default::default() }
    }

    fn softmax(l: &[f32], t: f64) -> Vec<f64> {
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = l.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|x| x / s).collect()
    }

    const LOGITS: [f32; 6] = [1.0, 3.0, 2.5, -1.0, 0.0, 2.9];

    #[test]
    fn greedy_and_temperature_zero_is_argmax() {
        assert_eq!(argmax(&LOGITS), Some(1));
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NEG_INFINITY]), Some(1));
        assert_eq!(argmax(&[f32::NAN]), None);
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&LOGITS).unwrap(), 1);
        }
        // A tiny temperature concentrates all mass on the argmax.
        let mut s = Sampler::new(cfg(1e-4)).unwrap();
        assert!((0..200).all(|_| s.sample(&LOGITS).unwrap() == 1));
        assert!(Sampler::new(cfg(1.0)).unwrap().sample(&[f32::NAN, f32::NEG_INFINITY]).is_err());
    }

    #[test]
    fn verifying_a_draft_keeps_the_target_distribution() {
        // The emitted id (the draft when accepted, the replacement otherwise) is distributed as plain sampling
        // draws: checked for a likely, an unlikely and a filtered-out (probability 0) draft, within 4.5 standard
        // errors of 200k draws each (a deterministic seed, so the check is repeatable).
        let c = SamplerConfig { top_k: 4, ..cfg(0.8) };
        let p = filtered_distribution(&LOGITS, &c).unwrap();
        let n = 200_000;
        for drafted in [1u32, 0, 3] {
            let mut s = Sampler::new(c.clone()).unwrap();
            let mut counts = [0usize; LOGITS.len()];
            let mut accepted = 0usize;
            for _ in 0..n {
                let id = match s.verify_drafted(&LOGITS, drafted).unwrap() {
                    Verdict::Accept => {
                        accepted += 1;
                        drafted
                    }
                    Verdict::Reject(x) => {
                        assert_ne!(x, drafted, "a rejected draft is never its own replacement");
                        x
                    }
                };
                counts[id as usize] += 1;
            }
            let pd = p.iter().find(|x| x.0 == drafted).map_or(0.0, |x| x.1);
            let se = (pd * (1.0 - pd) / n as f64).sqrt();
            assert!((accepted as f64 / n as f64 - pd).abs() <= 4.5 * se + 1e-12, "draft {drafted}: acceptance rate");
            for (id, &k) in counts.iter().enumerate() {
                let want = p.iter().find(|x| x.0 == id as u32).map_or(0.0, |x| x.1);
                let got = k as f64 / n as f64;
                let se = (want * (1.0 - want) / n as f64).sqrt();
                assert!((got - want).abs() <= 4.5 * se + 1e-12, "draft {drafted}: id {id}: {got} vs {want}");
            }
        }
        // Temperature 0: accept exactly the argmax; anything else is replaced by it.
        let mut g = Sampler::new(SamplerConfig::greedy()).unwrap();
        assert_eq!(g.verify_drafted(&LOGITS, 1).unwrap(), Verdict::Accept);
        assert_eq!(g.verify_drafted(&LOGITS, 5).unwrap(), Verdict::Reject(1));
        // Penalties shape the distribution verification uses, as they shape sampling.
        let mut r = Sampler::new(SamplerConfig { presence_penalty: 10.0, ..SamplerConfig::greedy() }).unwrap();
        r.accept(1);
        assert_eq!(r.distribution(&LOGITS).unwrap(), vec![(5, 1.0)]);
        assert_eq!(r.verify_drafted(&LOGITS, 1).unwrap(), Verdict::Reject(5));
    }

    #[test]
    fn same_seed_same_ids() {
        let run = |seed| {
            let mut s = Sampler::new(SamplerConfig { seed, ..cfg(1.0) }).unwrap();
            (0..64).map(|_| s.sample(&LOGITS).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn top_k_keeps_k_most_likely() {
        let d = filtered_distribution(&LOGITS, &SamplerConfig { top_k: 2, ..cfg(1.0) }).unwrap();
        let ids: Vec<u32> = d.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 5]);
        let p = softmax(&[3.0, 2.9], 1.0);
        assert!((d[0].1 - p[0]).abs() < 1e-12 && (d[1].1 - p[1]).abs() < 1e-12);
    }

    #[test]
    fn top_p_keeps_the_minimal_mass_set() {
        let p = softmax(&LOGITS, 1.0);
        let mut order: Vec<usize> = (0..LOGITS.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        for top_p in [0.05f32, 0.3, 0.5, 0.7, 0.9, 0.99] {
            let d = filtered_distribution(&LOGITS, &SamplerConfig { top_p, ..cfg(1.0) }).unwrap();
            let k = d.len();
            let mass = |n: usize| order[..n].iter().map(|&i| p[i]).sum::<f64>();
            assert!(mass(k) >= top_p as f64 - 1e-12, "top_p {top_p}: kept set too small");
            assert!(k == 1 || mass(k - 1) < top_p as f64, "top_p {top_p}: kept set not minimal");
            let ids: Vec<u32> = d.iter().map(|x| x.0).collect();
            assert_eq!(ids, order[..k].iter().map(|&i| i as u32).collect::<Vec<_>>());
            assert!((d.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn min_p_cuts_relative_to_the_best() {
        let p = softmax(&LOGITS, 1.0);
        let pmax = p[1];
        for min_p in [0.05f32, 0.3, 0.6, 0.95] {
            let d = filtered_distribution(&LOGITS, &SamplerConfig { min_p, ..cfg(1.0) }).unwrap();
            let kept: HashSet<u32> = d.iter().map(|x| x.0).collect();
            for (i, &pi) in p.iter().enumerate() {
                assert_eq!(kept.contains(&(i as u32)), pi >= min_p as f64 * pmax, "min_p {min_p} id {i}");
            }
        }
    }

    #[test]
    fn frequencies_match_softmax() {
        // 40k draws at T = 0.7; each frequency must be within 5 standard errors of its probability.
        let t = 0.7;
        let p = softmax(&LOGITS, t as f64);
        let mut s = Sampler::new(cfg(t)).unwrap();
        let n = 40_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample(&LOGITS).unwrap() as usize] += 1;
        }
        for i in 0..6 {
            let f = counts[i] as f64 / n as f64;
            let se = (p[i] * (1.0 - p[i]) / n as f64).sqrt();
            assert!((f - p[i]).abs() <= 5.0 * se + 1e-9, "id {i}: freq {f} vs p {}", p[i]);
        }
    }

    #[test]
    fn structural_tokens_are_greedy_and_penalties_apply() {
        let mut s = Sampler::new(cfg(5.0)).unwrap();
        s.set_structural_tokens([1]);
        assert!((0..100).all(|_| s.sample(&LOGITS).unwrap() == 1));
        assert!((0..100).all(|_| s.sample_with(&[0.0, 1.0, 2.0], true).unwrap() == 2));
        // Presence penalty pushes a seen id below the others under greedy decoding.
        let mut s = Sampler::new(SamplerConfig { presence_penalty: 1.0, ..SamplerConfig::greedy() }).unwrap();
        assert_eq!(s.sample(&LOGITS).unwrap(), 1);
        s.accept(1);
        assert_eq!(s.sample(&LOGITS).unwrap(), 5);
        let mut s = Sampler::new(SamplerConfig { repetition_penalty: 2.0, ..SamplerConfig::greedy() }).unwrap();
        s.accept(1);
        assert_eq!(s.sample(&LOGITS).unwrap(), 5);
    }

    #[test]
    fn invalid_settings_are_errors() {
        for c in [
            SamplerConfig { temperature: -1.0, ..Default::default() },
            SamplerConfig { temperature: f32::NAN, ..Default::default() },
            SamplerConfig { top_p: 0.0, ..Default::default() },
            SamplerConfig { top_p: 1.5, ..Default::default() },
            SamplerConfig { min_p: -0.1, ..Default::default() },
            SamplerConfig { repetition_penalty: 0.0, ..Default::default() },
        ] {
            assert!(Sampler::new(c).is_err());
        }
    }
}
