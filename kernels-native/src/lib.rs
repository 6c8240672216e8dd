//! Native overrides of ds4 ops: a table the executor consults before a backend's portable kernel.
//!
//! An override is a row of [`OVERRIDES`]: the op kind it replaces (the names of `ds4_engine::graph::Op::KINDS`),
//! the backend that hosts it (that backend owns the buffers and hands the kernel plain slices), a predicate on the
//! node's [`Shape`], and the kernel itself ([`Kernel`], one variant per op signature this crate knows).
//!
//! Invariants: an override computes exactly what the portable kernel it replaces computes, to the bit unless its
//! row says otherwise (the engine's tests compare them); kernels here never allocate, never panic on in-range
//! input, and depend on nothing from the engine (the engine depends on this crate).
//!
//! Adding one: write the kernel in one file under a backend folder (see [`cpu::swiglu`]), add its variant to
//! [`Kernel`] if the signature is new (the hosting backend then needs to learn it once), and add one line to
//! [`OVERRIDES`].

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_host;
pub mod cuda_kernels;

/// The shape of a node as the placement sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Batch rows of the tick.
    pub rows: usize,
    /// Length of one row of the op (e.g. the expert FFN width for `swiglu`).
    pub width: usize,
}

/// A kernel, by signature.
#[derive(Clone, Copy, Debug)]
pub enum Kernel {
    /// One row of the clamped SwiGLU: `gate ← silu(min(gate, limit)) · clamp(up, −limit, limit)`.
    SwiGlu(fn(gate: &mut [f32], up: &[f32], limit: f32)),
}

/// One override: see the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Override {
    /// Short name, for logs and placement reports.
    pub name: &'static str,
    /// The op kind replaced (`ds4_engine::graph::Op::name`).
    pub op: &'static str,
    /// The hosting backend's name (`"cpu"`, `"wgpu"`).
    pub backend: &'static str,
    /// Whether the override applies to a node of this shape.
    pub applies: fn(&Shape) -> bool,
    pub kernel: Kernel,
}

/// The registry (see the module docs). First match wins.
pub static OVERRIDES: &[Override] = &[cpu::swiglu::OVERRIDE];

/// The first override of `OVERRIDES` for op kind `op` on `backend` that applies to `shape`.
pub fn find(op: &str, backend: &str, shape: &Shape) -> Option<&'static Override> {
    OVERRIDES.iter().find(|o| o.op == op && o.backend == backend && (o.applies)(shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_matches_op_backend_and_shape() {
        let s = Shape { rows: 3, width: 64 };
        assert_eq!(find("swiglu", "cpu", &s).map(|o| o.name), Some("cpu-swiglu-x8"));
        assert!(find("swiglu", "wgpu", &s).is_none());
        assert!(find("rms_norm", "cpu", &s).is_none());
        assert!(find("swiglu", "cpu", &Shape { rows: 3, width: 12 }).is_none(), "width not a multiple of 8");
    }
}
