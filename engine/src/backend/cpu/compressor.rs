//! The KV compressor (main and indexer): pooling a block of projected token features into one compressed row.
//!
//! Per token the caller hands [`push`] its projected features `C` and gate logits `Z` (`coff·dim` each); `ape` is
//! added to the gate here (slot `pos % ratio`). When the block completes, [`push`] writes the pooled (pre-norm)
//! row: per feature a softmax over the block's slots of the gate logits, weighting `C`.
//! - HCA (`coff = 1`): the `ratio` slots of the block.
//! - CSA (`coff = 2`): `2·ratio` slots — the previous block's first half `Ca` (if any), then this block's second
//!   half `Cb`; afterwards this block's `Ca` becomes the carried `prev`.
//!
//! The caller then applies RMSNorm · norm, RoPE at the block's first position and (sim mode) the rounding.

use crate::tables::Frontier;

/// Adds one token; returns true when a block completed and `out[..dim]` holds its pooled row.
pub fn push(f: &mut Frontier, kv: &[f32], gate: &[f32], ape: &[f32], out: &mut [f32]) -> bool {
    let w = f.coff * f.dim;
    let slot = f.n_pending;
    f.pending_kv[slot * w..(slot + 1) * w].copy_from_slice(&kv[..w]);
    let g = &mut f.pending_gate[slot * w..(slot + 1) * w];
    for ((o, &z), &a) in g.iter_mut().zip(&gate[..w]).zip(&ape[slot * w..(slot + 1) * w]) {
        *o = z + a;
    }
    f.n_pending += 1;
    if f.n_pending < f.ratio {
        return false;
    }
    let (m, dim) = (f.ratio, f.dim);
    let off = if f.coff == 2 { dim } else { 0 };
    for (c, o) in out.iter_mut().enumerate().take(dim) {
        let mut mx = f32::NEG_INFINITY;
        if f.coff == 2 && f.has_prev {
            for j in 0..m {
                mx = mx.max(f.prev_gate[j * dim + c]);
            }
        }
        for j in 0..m {
            mx = mx.max(f.pending_gate[j * w + off + c]);
        }
        let mut den = 0f32;
        let mut num = 0f32;
        if f.coff == 2 && f.has_prev {
            for j in 0..m {
                let e = (f.prev_gate[j * dim + c] - mx).exp();
                den += e;
                num += e * f.prev_kv[j * dim + c];
            }
        }
        for j in 0..m {
            let e = (f.pending_gate[j * w + off + c] - mx).exp();
            den += e;
            num += e * f.pending_kv[j * w + off + c];
        }
        *o = num / den;
    }
    if f.coff == 2 {
        for j in 0..m {
            f.prev_kv[j * dim..(j + 1) * dim].copy_from_slice(&f.pending_kv[j * w..j * w + dim]);
            f.prev_gate[j * dim..(j + 1) * dim].copy_from_slice(&f.pending_gate[j * w..j * w + dim]);
        }
        f.has_prev = true;
    }
    f.n_pending = 0;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hca_pools_with_softmax_weights() {
        let mut f = Frontier::new(2, 1, 1);
        let ape = [0.0f32, 0.0];
        let mut out = [0f32];
        assert!(!push(&mut f, &[1.0], &[0.0], &ape, &mut out));
        assert!(push(&mut f, &[3.0], &[2f32.ln()], &ape, &mut out));
        // weights 1/3, 2/3
        assert!((out[0] - (1.0 / 3.0 + 2.0)).abs() < 1e-6);
        assert_eq!(f.n_pending, 0);
    }

    #[test]
    fn csa_overlaps_previous_block_first_half() {
        // ratio 1, dim 1: each token is one block; features [Ca, Cb].
        let mut f = Frontier::new(1, 1, 2);
        let ape = [0.0f32, 0.0];
        let mut out = [0f32];
        assert!(push(&mut f, &[10.0, 2.0], &[0.0, 0.0], &ape, &mut out));
        assert_eq!(out[0], 2.0); // no previous block: only Cb
        assert!(push(&mut f, &[20.0, 4.0], &[0.0, 0.0], &ape, &mut out));
        assert_eq!(out[0], (10.0 + 4.0) / 2.0); // Ca of block 0 and Cb of block 1, equal gates
                                                // ape is added to the gate of the slot
        let ape2 = [0.0f32, 3f32.ln()];
        assert!(push(&mut f, &[0.0, 8.0], &[0.0, 0.0], &ape2, &mut out));
        assert!((out[0] - (20.0 * 0.25 + 8.0 * 0.75)).abs() < 1e-5);
    }
}
