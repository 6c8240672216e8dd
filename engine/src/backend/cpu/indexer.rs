//! The lightning indexer's selection for one query: score every visible compressed row, keep the top `k`.
//!
//! `I(t, s) = Σ_h w_h · ReLU(q_h · K_s) · idx_head_dim^-½`, where `w_h` already carries `idx_heads^-½`. Ties
//! break toward the lower row index (stable), and the selection is returned in ascending row order.

use super::fdot::dots;

#[allow(clippy::too_many_arguments)]
/// Selects rows for one query. `q`: `heads × dim`; `w`: `heads`; `keys`: the key rows in order as consecutive
/// slices of whole rows (a session's pages), of which the first `n_vis` are visible; `scores`: scratch (on return,
/// when `n_vis > topk`, each visible row's score); `out`: receives the selected row indices (ascending); returns the
/// count (`min(topk, n_vis)`).
pub fn select<'k>(
    q: &[f32],
    w: &[f32],
    keys: impl IntoIterator<Item = &'k [f32]>,
    n_vis: usize,
    dim: usize,
    topk: usize,
    scores: &mut Vec<f32>,
    order: &mut Vec<u32>,
    out: &mut [u32],
) -> usize {
    if n_vis <= topk {
        for (i, o) in out.iter_mut().take(n_vis).enumerate() {
            *o = i as u32;
        }
        return n_vis;
    }
    let scale = 1.0 / (dim as f32).sqrt();
    scores.clear();
    let mut rows = keys.into_iter().flat_map(|page| page.chunks_exact(dim.max(1))).take(n_vis);
    loop {
        match (rows.next(), rows.next()) {
            (Some(k0), Some(k1)) => scores.extend_from_slice(&score([k0, k1], q, w, dim, scale)),
            (Some(k0), None) => scores.push(score([k0], q, w, dim, scale)[0]),
            _ => break,
        }
    }
    order.clear();
    order.extend(0..n_vis as u32);
    let cmp = |a: &u32, b: &u32| {
        let (sa, sb) = (scores[*a as usize], scores[*b as usize]);
        sb.partial_cmp(&sa).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(b))
    };
    order.select_nth_unstable_by(topk - 1, cmp);
    let sel = &mut order[..topk];
    sel.sort_unstable();
    out[..topk].copy_from_slice(sel);
    topk
}

/// Heads per dot tile of [`score`].
const HEADS: usize = 4;

/// `I(t, s)` of `K` key rows: per key `Σ_h ReLU(q_h · K_s) · scale · w_h`, each term added in head order, every dot
/// exactly [`super::matmul::dot_f32`] (computed [`HEADS`] heads × `K` keys per [`dots`] tile).
fn score<const K: usize>(keys: [&[f32]; K], q: &[f32], w: &[f32], dim: usize, scale: f32) -> [f32; K] {
    let mut acc = [0f32; K];
    let mut add = |d: &[f32; K], h: usize| {
        for (a, &v) in acc.iter_mut().zip(d) {
            *a += v.max(0.0) * scale * w[h];
        }
    };
    let qh = |h: usize| &q[h * dim..(h + 1) * dim];
    let mut h = 0;
    while h + HEADS <= w.len() {
        let d = dots::<HEADS, K>(std::array::from_fn(|i| qh(h + i)), keys, dim);
        for (i, di) in d.iter().enumerate() {
            add(di, h + i);
        }
        h += HEADS;
    }
    for h in h..w.len() {
        add(&dots([qh(h)], keys, dim)[0], h);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::super::matmul::dot_f32;
    use super::*;

    /// The per-key loop `score` replaced (kept as the reference): one `dot_f32` per head.
    fn reference_scores(q: &[f32], w: &[f32], keys: &[f32], dim: usize) -> Vec<f32> {
        let scale = 1.0 / (dim as f32).sqrt();
        keys.chunks_exact(dim)
            .map(|k| {
                let mut acc = 0f32;
                for h in 0..w.len() {
                    let d = dot_f32(&q[h * dim..(h + 1) * dim], k);
                    acc += d.max(0.0) * scale * w[h];
                }
                acc
            })
            .collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        super::super::fdot::tests::random_values(n, seed, 1.0)
    }

    #[test]
    fn tiled_scores_match_one_dot_per_head_bit_for_bit() {
        // 64 heads × 128 (Flash), a head count with a remainder, odd row counts, keys split over uneven pages.
        for (heads, dim, n_vis) in [(64usize, 128usize, 1001usize), (6, 36, 77), (3, 8, 40)] {
            let q = values(heads * dim, heads as u32);
            let w = values(heads, 5);
            let keys = values(n_vis * dim, dim as u32);
            let cut = (n_vis / 3) * dim;
            let (mut s, mut o) = (Vec::new(), Vec::new());
            let mut out = vec![0u32; n_vis];
            let topk = n_vis / 4;
            let n = select(&q, &w, [&keys[..cut], &keys[cut..]], n_vis, dim, topk, &mut s, &mut o, &mut out);
            assert_eq!(n, topk);
            let want = reference_scores(&q, &w, &keys, dim);
            assert_eq!(s.len(), n_vis);
            for (i, (g, r)) in s.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), r.to_bits(), "heads {heads} dim {dim} row {i}");
            }
            // The selection is the reference scores' top k (descending, ties to the lower index).
            let mut idx: Vec<u32> = (0..n_vis as u32).collect();
            idx.sort_by(|a, b| {
                want[*b as usize].partial_cmp(&want[*a as usize]).expect("finite scores").then(a.cmp(b))
            });
            let mut top = idx[..topk].to_vec();
            top.sort_unstable();
            assert_eq!(&out[..n], &top[..]);
        }
    }

    #[test]
    fn keeps_top_scores_with_low_index_ties() {
        // one head, dim 1, weight 1: score = relu(q·k)
        let keys = [1.0f32, 3.0, -2.0, 3.0, 2.0];
        let (mut s, mut o) = (Vec::new(), Vec::new());
        let mut out = [0u32; 5];
        let n = select(&[1.0], &[1.0], [&keys[..2], &keys[2..]], 5, 1, 2, &mut s, &mut o, &mut out);
        assert_eq!(&out[..n], &[1, 3]);
        let n = select(&[1.0], &[1.0], [&keys[..]], 5, 1, 3, &mut s, &mut o, &mut out);
        assert_eq!(&out[..n], &[1, 3, 4]);
        // ReLU ties at zero: negative query makes all scores 0 -> lowest indices win.
        let n = select(&[-1.0], &[1.0], [&[1.0, 2.0, 3.0][..]], 3, 1, 2, &mut s, &mut o, &mut out);
        assert_eq!(&out[..n], &[0, 1]);
        // fewer visible rows than k: all of them.
        let n = select(&[1.0], &[1.0], [&[5.0, 6.0, 9.0][..]], 2, 1, 4, &mut s, &mut o, &mut out);
        assert_eq!(&out[..n], &[0, 1]);
    }
}
