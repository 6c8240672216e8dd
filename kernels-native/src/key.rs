//! The typed key an override is registered under: which backend hosts it ([`BackendKind`]), which op kind it
//! replaces ([`OpKind`]), and the node properties it is specialised for ([`WeightType`], [`ExpertLayout`],
//! [`ShapeClass`]). The engine builds a [`NodeKey`] for every node it places and asks [`crate::find`]; an
//! override's [`Pattern`] leaves a property open with `None` ("any").
//!
//! These enums are the one definition of each name: the engine re-exports [`BackendKind`] (its backend registry)
//! and maps its graph ops onto [`OpKind`] (`ds4_engine::graph::Op::op_kind`), so an op kind, a backend or a weight
//! type is never spelled as a string in a key.

use std::fmt;

/// A compute backend of the engine (the registry: `ds4_engine::backend::registry` creates them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The reference CPU backend.
    #[default]
    Cpu,
    /// WGSL compute shaders via wgpu.
    Wgpu,
    /// CUDA kernels (`kernels-native/cuda`) on an NVIDIA GPU, with the CPU beside it for the ops they do not
    /// cover yet.
    Cuda,
}

impl BackendKind {
    /// Every backend, in the order help texts list them.
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda];

    /// The backend's short name (`"cpu"`, `"wgpu"`, `"cuda"`): what command lines accept and reports print.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown backend name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?} (expected one of: cpu, wgpu, cuda)")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        BackendKind::ALL.into_iter().find(|b| b.name() == s.trim()).ok_or_else(|| UnknownBackend(s.to_string()))
    }
}

/// The op kinds of the engine's node graph (`ds4_engine::graph::Op`), in the order of its `Op::KINDS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    Embed,
    RmsNorm,
    MatMul,
    GroupedMatMul,
    Rope,
    ActSim,
    Scale,
    CompressPush,
    IndexerTopK,
    SparseAttention,
    WindowStore,
    HcSinkhorn,
    HcHeadWeights,
    HcCollapse,
    HcPost,
    MoeRoute,
    ExpertUp,
    SwiGlu,
    ExpertDown,
    MoeCombine,
    Logits,
    Readback,
    MtpInput,
    TapStreams,
    LogitCandidates,
}

impl OpKind {
    /// Every kind, indexed by its discriminant.
    pub const ALL: [OpKind; 25] = [
        OpKind::Embed,
        OpKind::RmsNorm,
        OpKind::MatMul,
        OpKind::GroupedMatMul,
        OpKind::Rope,
        OpKind::ActSim,
        OpKind::Scale,
        OpKind::CompressPush,
        OpKind::IndexerTopK,
        OpKind::SparseAttention,
        OpKind::WindowStore,
        OpKind::HcSinkhorn,
        OpKind::HcHeadWeights,
        OpKind::HcCollapse,
        OpKind::HcPost,
        OpKind::MoeRoute,
        OpKind::ExpertUp,
        OpKind::SwiGlu,
        OpKind::ExpertDown,
        OpKind::MoeCombine,
        OpKind::Logits,
        OpKind::Readback,
        OpKind::MtpInput,
        OpKind::TapStreams,
        OpKind::LogitCandidates,
    ];

    /// The kind's snake-case name (what op timings and placement reports print).
    pub const fn name(self) -> &'static str {
        use OpKind::*;
        match self {
            Embed => "embed",
            RmsNorm => "rms_norm",
            MatMul => "matmul",
            GroupedMatMul => "grouped_matmul",
            Rope => "rope",
            ActSim => "act_sim",
            Scale => "scale",
            CompressPush => "compress_push",
            IndexerTopK => "indexer_topk",
            SparseAttention => "sparse_attention",
            WindowStore => "window_store",
            HcSinkhorn => "hc_sinkhorn",
            HcHeadWeights => "hc_head_weights",
            HcCollapse => "hc_collapse",
            HcPost => "hc_post",
            MoeRoute => "moe_route",
            ExpertUp => "expert_up",
            SwiGlu => "swiglu",
            ExpertDown => "expert_down",
            MoeCombine => "moe_combine",
            Logits => "logits",
            Readback => "readback",
            MtpInput => "mtp_input",
            TapStreams => "tap_streams",
            LogitCandidates => "logit_candidates",
        }
    }
}

/// The storage type of the weight a node reads (for the nodes that read one: the products; the expert FFN nodes
/// name their layer's expert weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q2K,
    Q4K,
    Iq2Xxs,
    /// Any other ggml type (no override specialises on it yet).
    Other,
}

/// How an MoE node lays out its routed rows (the engine's `graph::Experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertLayout {
    /// Slot row `r·k + j` is row `r`'s `j`-th choice.
    PerRow,
    /// Slot rows gathered by expert.
    ByExpert,
}

/// The batch size of a tick, in the classes kernels specialise on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShapeClass {
    /// One row (a single session decoding).
    Decode,
    /// 2..=[`ShapeClass::SMALL_MAX`] rows (batched decode, short prefill chunks).
    Small,
    /// More rows (prefill).
    Prefill,
}

impl ShapeClass {
    /// Largest batch of [`ShapeClass::Small`].
    pub const SMALL_MAX: usize = 32;

    /// The class of a tick of `rows` rows.
    pub fn of(rows: usize) -> ShapeClass {
        match rows {
            0 | 1 => ShapeClass::Decode,
            2..=Self::SMALL_MAX => ShapeClass::Small,
            _ => ShapeClass::Prefill,
        }
    }
}

/// What the placement knows about one node: the key an override is looked up by, plus the exact sizes its
/// predicate may check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeKey {
    pub backend: BackendKind,
    pub op: OpKind,
    /// The weight's type, for a node that reads one.
    pub weight: Option<WeightType>,
    /// The routed-row layout, for an MoE node that has one.
    pub experts: Option<ExpertLayout>,
    pub shape: ShapeClass,
    /// Batch rows of the tick.
    pub rows: usize,
    /// Length of one row of the op (e.g. the expert FFN width for [`OpKind::SwiGlu`]).
    pub width: usize,
}

/// The key an override is registered under; `None` matches any value of that property.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pattern {
    pub backend: BackendKind,
    pub op: OpKind,
    pub weight: Option<WeightType>,
    pub experts: Option<ExpertLayout>,
    pub shape: Option<ShapeClass>,
}

impl Pattern {
    /// A pattern for `op` on `backend` with every other property open.
    pub const fn any(backend: BackendKind, op: OpKind) -> Pattern {
        Pattern { backend, op, weight: None, experts: None, shape: None }
    }

    /// Whether `key` has this pattern's backend and op kind and every property the pattern fixes.
    pub fn matches(&self, key: &NodeKey) -> bool {
        fn open<T: PartialEq>(want: Option<T>, got: Option<T>) -> bool {
            want.is_none() || want == got
        }
        self.backend == key.backend
            && self.op == key.op
            && open(self.weight, key.weight)
            && open(self.experts, key.experts)
            && open(self.shape, Some(key.shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_kinds_are_indexed_by_discriminant() {
        for b in BackendKind::ALL {
            assert_eq!(b.name().parse::<BackendKind>(), Ok(b));
        }
        let err = "tpu".parse::<BackendKind>().unwrap_err().to_string();
        assert!(err.contains("tpu") && err.contains("cpu, wgpu"), "{err}");
        for (i, k) in OpKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
        let mut names: Vec<_> = OpKind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), OpKind::ALL.len(), "names are unique");
    }

    #[test]
    fn shape_classes_and_open_properties() {
        assert_eq!(ShapeClass::of(1), ShapeClass::Decode);
        assert_eq!(ShapeClass::of(2), ShapeClass::Small);
        assert_eq!(ShapeClass::of(ShapeClass::SMALL_MAX), ShapeClass::Small);
        assert_eq!(ShapeClass::of(ShapeClass::SMALL_MAX + 1), ShapeClass::Prefill);
        let key = NodeKey {
            backend: BackendKind::Cpu,
            op: OpKind::ExpertUp,
            weight: Some(WeightType::Iq2Xxs),
            experts: Some(ExpertLayout::ByExpert),
            shape: ShapeClass::Prefill,
            rows: 100,
            width: 64,
        };
        let any = Pattern::any(BackendKind::Cpu, OpKind::ExpertUp);
        assert!(any.matches(&key));
        assert!(!Pattern { backend: BackendKind::Wgpu, ..any }.matches(&key));
        assert!(!Pattern { op: OpKind::ExpertDown, ..any }.matches(&key));
        assert!(Pattern { weight: Some(WeightType::Iq2Xxs), ..any }.matches(&key));
        assert!(!Pattern { weight: Some(WeightType::Q8_0), ..any }.matches(&key));
        assert!(!Pattern { experts: Some(ExpertLayout::PerRow), ..any }.matches(&key));
        assert!(!Pattern { shape: Some(ShapeClass::Decode), ..any }.matches(&key));
        let no_weight = NodeKey { weight: None, ..key };
        assert!(!Pattern { weight: Some(WeightType::Iq2Xxs), ..any }.matches(&no_weight), "fixed vs none");
    }
}
