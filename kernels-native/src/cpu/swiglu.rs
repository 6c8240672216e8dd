//! The clamped SwiGLU of the expert FFNs, in blocks of 8: the clamps are done for the whole block first (they
//! vectorise), then the `silu` products. The same operations per element as the portable kernel, in the same
//! order, so the result is bit-identical.

use crate::{BackendKind, NativeKernel, NodeKey, OpKind, Override, Pattern};

/// Registry row (see [`crate::OVERRIDES`]): every SwiGLU on the CPU whose expert width is whole blocks of 8.
pub const OVERRIDE: Override = Override {
    name: "cpu-swiglu-x8",
    key: Pattern::any(BackendKind::Cpu, OpKind::SwiGlu),
    applies: |k: &NodeKey| k.width.is_multiple_of(8),
    kernel: NativeKernel::SwiGlu(swiglu_x8),
};

/// `gate ← silu(min(gate, limit)) · clamp(up, −limit, limit)` for one row; `gate.len()` a multiple of 8 and
/// `up.len() ≥ gate.len()` (extra values are ignored; a tail that is not a whole block is done element-wise).
pub fn swiglu_x8(gate: &mut [f32], up: &[f32], limit: f32) {
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    let mut gb = gate.chunks_exact_mut(8);
    let mut ub = up.chunks_exact(8);
    for (g, u) in (&mut gb).zip(&mut ub) {
        let mut a = [0f32; 8];
        let mut b = [0f32; 8];
        for i in 0..8 {
            a[i] = g[i].min(limit);
            b[i] = u[i].clamp(-limit, limit);
        }
        for i in 0..8 {
            g[i] = a[i] / (1.0 + (-a[i]).exp()) * b[i];
        }
    }
    for (g, &u) in gb.into_remainder().iter_mut().zip(ub.remainder()) {
        let a = g.min(limit);
        *g = a / (1.0 + (-a).exp()) * u.clamp(-limit, limit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_scalar_formula_bit_for_bit() {
        let limit = 7.0f32;
        let gate: Vec<f32> = (0..37).map(|i| ((i * 7919 % 113) as f32 - 56.0) * 0.21).collect();
        let up: Vec<f32> = (0..37).map(|i| ((i * 104_729 % 97) as f32 - 48.0) * 0.23).collect();
        let mut got = gate.clone();
        swiglu_x8(&mut got, &up, limit);
        for i in 0..gate.len() {
            let a = gate[i].min(limit);
            let want = a / (1.0 + (-a).exp()) * up[i].clamp(-limit, limit);
            assert_eq!(got[i].to_bits(), want.to_bits(), "element {i}");
        }
        assert!(gate.iter().any(|&g| g > limit) && up.iter().any(|&u| u < -limit), "the clamps are exercised");
    }
}
