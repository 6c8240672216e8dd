//! Logit candidates: the few best logits of a row, which is all most samplers look at.
//!
//! A greedy sampler needs the best id; a top-k sampler (with no penalties) needs the `k` best ids and their logits:
//! [`filtered_distribution`] keeps only those, so the row with every other logit at −∞ gives the same
//! distribution, bit for bit, and the same draw. A device backend therefore reads back `k` (id, value) pairs per
//! row instead of `vocab` values ([`crate::graph::Op::LogitCandidates`], [`crate::graph::Batch::candidates`]).
//!
//! The order is total, so every backend picks the same set: larger value first; among equal values (−0 equals
//! +0) the lower id first; NaN and −∞ are never candidates (nor does [`argmax`] or [`filtered_distribution`]
//! ever take them). [`top_candidates`] is the definition the device kernels are tested against.
//!
//! [`filtered_distribution`]: super::filtered_distribution
//! [`argmax`]: super::argmax

use super::SamplerConfig;

/// Whether `x` can be a candidate: not NaN, not −∞.
fn eligible(x: f32) -> bool {
    !x.is_nan() && x != f32::NEG_INFINITY
}

/// Writes the `ids.len()` best entries of `row` (see the module doc for the order) into `ids` and `vals`, best
/// first; when the row has fewer eligible values, the rest of `ids` is `u32::MAX` and of `vals` −∞.
/// `ids` and `vals` have the same length.
pub fn top_candidates(row: &[f32], ids: &mut [u32], vals: &mut [f32]) {
    let k = ids.len().min(vals.len());
    // Insertion into a short sorted list: k is small (≤ 64) next to the row.
    let mut n = 0;
    let better = |a: (f32, usize), b: (f32, usize)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
    for (i, &x) in row.iter().enumerate() {
        if !eligible(x) || k == 0 {
            continue;
        }
        if n == k && !better((x, i), (vals[k - 1], ids[k - 1] as usize)) {
            continue;
        }
        let mut j = n.min(k - 1);
        while j > 0 && better((x, i), (vals[j - 1], ids[j - 1] as usize)) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j -= 1;
        }
        vals[j] = x;
        ids[j] = i as u32;
        n = (n + 1).min(k);
    }
    ids[n..k].fill(u32::MAX);
    vals[n..k].fill(f32::NEG_INFINITY);
}

/// Writes a logits row of which only the candidates are known: −∞ everywhere, each candidate's value at its id
/// (ids past the row or `u32::MAX` are skipped). For a sampler whose [`SamplerConfig::candidates`] is at most the
/// number of candidates, this row draws exactly what the whole row would.
pub fn expand_candidates(ids: &[u32], vals: &[f32], row: &mut [f32]) {
    row.fill(f32::NEG_INFINITY);
    for (&id, &v) in ids.iter().zip(vals) {
        if let Some(x) = row.get_mut(id as usize) {
            *x = v;
        }
    }
}

impl SamplerConfig {
    /// How many of a row's best logits this sampler's draw depends on, when that is fewer than the row: 1 for
    /// greedy decoding, `top_k` when top-k sampling is on; `None` when the draw reads the whole row (temperature
    /// without top-k: top-p and min-p see the whole distribution's mass) or when penalties rewrite logits outside
    /// the best ones. Structural tokens and forced greedy steps take the argmax, which is the first candidate.
    pub fn candidates(&self) -> Option<usize> {
        let penalties = self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0;
        if penalties {
            None
        } else if self.temperature == 0.0 {
            Some(1)
        } else if self.top_k > 0 {
            Some(self.top_k)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{argmax, filtered_distribution, Rng, Sampler};

    /// The reference: sort every eligible (value, id) by the order of the module doc.
    fn by_sorting(row: &[f32], k: usize) -> Vec<(u32, f32)> {
        let mut all: Vec<(u32, f32)> =
            row.iter().enumerate().filter(|(_, x)| eligible(**x)).map(|(i, &x)| (i as u32, x)).collect();
        all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    fn row_with_ties(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match rng.next_u64() % 16 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => -0.0,
                3 => 0.0,
                4 => f32::INFINITY,
                // Few distinct values: many ties.
                5..=9 => (rng.next_u64() % 4) as f32,
                _ => (rng.next_f64() as f32 - 0.5) * 20.0,
            })
            .collect()
    }

    #[test]
    fn candidates_are_the_best_entries_in_the_documented_order() {
        let mut rng = Rng::new(7);
        for n in [0, 1, 5, 64, 300] {
            for k in [1, 2, 8, 64] {
                let row = row_with_ties(&mut rng, n);
                let (mut ids, mut vals) = (vec![0; k], vec![0.0; k]);
                top_candidates(&row, &mut ids, &mut vals);
                let want = by_sorting(&row, k);
                for j in 0..k {
                    match want.get(j) {
                        Some(&(id, v)) => {
                            assert_eq!(ids[j], id, "n {n} k {k} slot {j}");
                            assert_eq!(vals[j].to_bits(), v.to_bits());
                        }
                        None => assert_eq!((ids[j], vals[j]), (u32::MAX, f32::NEG_INFINITY)),
                    }
                }
                if let Some(best) = argmax(&row) {
                    assert_eq!(ids[0], best, "the first candidate is the argmax");
                }
            }
        }
    }

    #[test]
    fn a_sampler_that_needs_k_candidates_draws_the_same_from_them() {
        let mut rng = Rng::new(11);
        for (temperature, top_k, top_p, min_p) in
            [(0.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 40, 0.9, 0.0), (1.0, 3, 0.5, 0.2), (2.0, 64, 1.0, 0.05)]
        {
            let cfg = SamplerConfig { temperature, top_k, top_p, min_p, seed: 3, ..Default::default() };
            let k = cfg.candidates().expect("no penalties, greedy or top-k");
            let (mut full, mut part) = (Sampler::new(cfg.clone()).unwrap(), Sampler::new(cfg.clone()).unwrap());
            full.set_structural_tokens([2]);
            part.set_structural_tokens([2]);
            for _ in 0..50 {
                let row = row_with_ties(&mut rng, 200);
                if argmax(&row).is_none() {
                    continue;
                }
                let (mut ids, mut vals) = (vec![0; k], vec![0.0; k]);
                top_candidates(&row, &mut ids, &mut vals);
                let mut sparse = vec![0.0; row.len()];
                expand_candidates(&ids, &vals, &mut sparse);
                let (a, b) =
                    (filtered_distribution(&row, &cfg).unwrap(), filtered_distribution(&sparse, &cfg).unwrap());
                assert_eq!(a.len(), b.len());
                assert!(a.iter().zip(&b).all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits()), "{cfg:?}");
                assert_eq!(full.sample(&row).unwrap(), part.sample(&sparse).unwrap(), "{cfg:?}");
            }
        }
    }

    #[test]
    fn samplers_that_read_the_whole_row_need_it() {
        let plain = SamplerConfig { temperature: 0.8, top_p: 0.9, ..Default::default() };
        assert_eq!(plain.candidates(), None);
        let penalised = SamplerConfig { presence_penalty: 0.5, ..SamplerConfig::greedy() };
        assert_eq!(penalised.candidates(), None);
        assert_eq!(SamplerConfig::greedy().candidates(), Some(1));
        assert_eq!(SamplerConfig { top_k: 20, ..Default::default() }.candidates(), Some(20));
    }
}
