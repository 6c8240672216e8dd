//! Native overrides of ds4 ops: a registry the executor consults before a backend's portable kernel.
//!
//! An override is a row of [`OVERRIDES`]: a typed [`Pattern`] (the hosting backend, the op kind it replaces, and
//! optionally the weight type, expert layout and batch-shape class it is specialised for — see [`key`]), a
//! predicate on the node's exact sizes ([`NodeKey`]), and the kernel itself ([`NativeKernel`], one variant per op
//! signature this crate knows). The hosting backend owns the buffers and hands the kernel its operands.
//!
//! Invariants: an override computes exactly what the portable kernel it replaces computes (the one meaning
//! documented on the engine's `graph::Op` variant), to the bit unless its row says otherwise (the engine's tests
//! compare them); kernels here never allocate, never panic on in-range input, and depend on nothing from the
//! engine (the engine depends on this crate). The first matching row wins, so a specialised row goes before a
//! general one for the same op.
//!
//! Adding one: write the kernel and its registry row in one file under its backend's folder (see
//! [`cpu::swiglu`]), and add that row to [`OVERRIDES`] (one line). Only a kernel with a new signature also needs a
//! [`NativeKernel`] variant, which the hosting backend's `run_native` then learns once.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_host;
pub mod cuda_kernels;
pub mod key;

pub use key::{BackendKind, ExpertLayout, NodeKey, OpKind, Pattern, ShapeClass, UnknownBackend, WeightType};

/// A native kernel, by signature.
#[derive(Clone, Copy, Debug)]
pub enum NativeKernel {
    /// One row of the clamped SwiGLU: `gate ← silu(min(gate, limit)) · clamp(up, −limit, limit)`.
    SwiGlu(fn(gate: &mut [f32], up: &[f32], limit: f32)),
}

/// One override: see the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Override {
    /// Short name, for logs and placement reports.
    pub name: &'static str,
    /// The nodes it may replace.
    pub key: Pattern,
    /// Whether it applies to a node matching [`Override::key`] with these exact sizes.
    pub applies: fn(&NodeKey) -> bool,
    pub kernel: NativeKernel,
}

/// The registry (see the module docs). First match wins.
pub static OVERRIDES: &[Override] = &[cpu::swiglu::OVERRIDE];

/// The first override of [`OVERRIDES`] whose pattern matches `key` and whose predicate accepts it.
pub fn find(key: &NodeKey) -> Option<&'static Override> {
    find_in(OVERRIDES, key)
}

/// [`find`] over another table (tests, and a backend trying rows before registering them).
pub fn find_in<'a>(table: &'a [Override], key: &NodeKey) -> Option<&'a Override> {
    table.iter().find(|o| o.key.matches(key) && (o.applies)(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swiglu(backend: BackendKind, width: usize) -> NodeKey {
        NodeKey {
            backend,
            op: OpKind::SwiGlu,
            weight: Some(WeightType::Iq2Xxs),
            experts: None,
            shape: ShapeClass::of(3),
            rows: 3,
            width,
        }
    }

    #[test]
    fn lookup_matches_op_backend_and_shape() {
        let k = swiglu(BackendKind::Cpu, 64);
        assert_eq!(find(&k).map(|o| o.name), Some("cpu-swiglu-x8"));
        assert!(find(&swiglu(BackendKind::Wgpu, 64)).is_none());
        assert!(find(&NodeKey { op: OpKind::RmsNorm, ..k }).is_none());
        assert!(find(&swiglu(BackendKind::Cpu, 12)).is_none(), "width not a multiple of 8");
    }

    /// A specialised row placed before a general one wins for its key only.
    #[test]
    fn first_matching_row_wins() {
        fn noop(_: &mut [f32], _: &[f32], _: f32) {}
        let general = cpu::swiglu::OVERRIDE;
        let special = Override {
            name: "decode-only",
            key: Pattern { shape: Some(ShapeClass::Decode), ..general.key },
            applies: |_| true,
            kernel: NativeKernel::SwiGlu(noop),
        };
        let table = [special, general];
        let decode = NodeKey { rows: 1, shape: ShapeClass::Decode, ..swiglu(BackendKind::Cpu, 64) };
        assert_eq!(find_in(&table, &decode).map(|o| o.name), Some("decode-only"));
        assert_eq!(find_in(&table, &swiglu(BackendKind::Cpu, 64)).map(|o| o.name), Some("cpu-swiglu-x8"));
    }
}
