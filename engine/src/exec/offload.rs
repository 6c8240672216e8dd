//! Offload: which parts of the model run on a second backend — the user's placement option
//! (`--placement experts=cpu`), for a GPU smaller than the model.
//!
//! A [`Placement`] names groups of ops and the backend each group runs on. The one group today is `experts`: an
//! MoE layer's router product, routing, routed and shared expert products, SwiGLU and combine
//! ([`Placement::EXPERT_OPS`] and the writer of the router scores, [`Placement::moved_writers`]). With
//! `experts=cpu` on a device primary (wgpu), the engine creates a CPU backend as the run's second backend and
//! forces those nodes there ([`crate::exec::Executor::force_fallback`], [`crate::exec::Executor::force_writers_of`]);
//! everything else — embeddings, attention and its KV pages, mHC, the head — stays on the GPU. The executor's
//! residency copies ([`crate::exec`]) then move, per MoE layer and row, the normed input down and the layer's
//! output up (`d_model` floats each way, one device sync); the router scores, routes and expert rows never cross
//! (each is used on one side only, which placement checks). A device backend uploads a weight the first time one
//! of its own nodes reads it, so the expert tensors — about 96 % of the 2-bit Flash file — are never uploaded: the
//! GPU holds attention, the embeddings, the head and the KV cache; the CPU reads the experts from the memory-mapped
//! file.
//!
//! Each layer's MoE half waits for its attention half and the next attention for the MoE output (one device
//! sync per layer); the CPU's expert work does not yet overlap the GPU's work of another row group.

use std::fmt;
use std::str::FromStr;

use ds4_kernels_native::{BackendKind, OpKind};

use crate::graph::BufId;
use crate::{Error, Result};

/// Where groups of ops run besides the primary backend (see the module docs). The default runs everything on
/// the primary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The backend of the MoE layers' expert ops ([`Placement::EXPERT_OPS`]); `None`: the primary's.
    pub experts: Option<BackendKind>,
}

impl Placement {
    /// The op kinds of the `experts` group.
    pub const EXPERT_OPS: [OpKind; 5] =
        [OpKind::MoeRoute, OpKind::ExpertUp, OpKind::SwiGlu, OpKind::ExpertDown, OpKind::MoeCombine];

    /// Routed and shared experts on the CPU, the rest on the primary.
    pub const EXPERTS_ON_CPU: Placement = Placement { experts: Some(BackendKind::Cpu) };

    /// The second backend a run with primary `primary` needs (`None`: one backend does everything), or an error
    /// for a placement this build cannot run: only the CPU takes a group away from a device primary.
    pub fn second_backend(&self, primary: BackendKind) -> Result<Option<BackendKind>> {
        match self.experts {
            None => Ok(None),
            Some(k) if k == primary => Ok(None),
            Some(BackendKind::Cpu) => Ok(Some(BackendKind::Cpu)),
            Some(k) => Err(Error::InvalidArgument(format!(
                "placement experts={k} with the {primary} backend: only experts=cpu (routed experts on the CPU, the \
                 rest on a GPU backend) is supported"
            ))),
        }
    }

    /// The tensors whose writers go to the second backend too: the router's scores (only the route reads them,
    /// so computing them beside it sends one tensor down per layer instead of two).
    pub fn moved_writers(&self, primary: BackendKind) -> &'static [BufId] {
        match self.experts {
            Some(k) if k != primary => &[BufId::Router],
            _ => &[],
        }
    }

    /// The op kinds ([`crate::graph::Op::kind`]) sent to the second backend.
    pub fn moved_kinds(&self, primary: BackendKind) -> Vec<usize> {
        match self.experts {
            Some(k) if k != primary => Self::EXPERT_OPS.iter().map(|&o| o as usize).collect(),
            _ => Vec::new(),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.experts {
            Some(k) => write!(f, "experts={k}"),
            None => f.write_str("default"),
        }
    }
}

impl FromStr for Placement {
    type Err = Error;

    /// `default` (or empty), or comma-separated `GROUP=BACKEND` pairs; the one group is `experts`.
    fn from_str(s: &str) -> Result<Placement> {
        let mut p = Placement::default();
        let s = s.trim();
        if s.is_empty() || s == "default" {
            return Ok(p);
        }
        for part in s.split(',') {
            let bad = || {
                Error::InvalidArgument(format!(
                    "placement {part:?}: expected GROUP=BACKEND (group: experts; backend: cpu, wgpu), e.g. experts=cpu"
                ))
            };
            let (group, backend) = part.split_once('=').ok_or_else(bad)?;
            let kind = crate::backend::registry::parse(backend.trim())?;
            match group.trim() {
                "experts" => p.experts = Some(kind),
                _ => return Err(bad()),
            }
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Op;

    #[test]
    fn placements_parse_and_name_the_moved_kinds() {
        assert_eq!("".parse::<Placement>().unwrap(), Placement::default());
        assert_eq!("default".parse::<Placement>().unwrap(), Placement::default());
        let p: Placement = " experts = cpu ".parse().unwrap();
        assert_eq!(p, Placement::EXPERTS_ON_CPU);
        assert_eq!(p.to_string().parse::<Placement>().unwrap(), p);
        for bad in ["experts", "attention=cpu", "experts=tpu", "experts=cpu,kv=cpu"] {
            let e = bad.parse::<Placement>().unwrap_err().to_string();
            assert!(e.contains("expected") || e.contains("tpu"), "{bad}: {e}");
        }
        assert_eq!(p.second_backend(BackendKind::Wgpu).unwrap(), Some(BackendKind::Cpu));
        assert_eq!(p.second_backend(BackendKind::Cpu).unwrap(), None);
        assert!(p.moved_kinds(BackendKind::Cpu).is_empty());
        let names: Vec<&str> = p.moved_kinds(BackendKind::Wgpu).into_iter().map(|k| Op::KINDS[k]).collect();
        assert_eq!(names, ["moe_route", "expert_up", "swiglu", "expert_down", "moe_combine"]);
        let gpu = Placement { experts: Some(BackendKind::Wgpu) };
        assert!(gpu.second_backend(BackendKind::Cpu).unwrap_err().to_string().contains("only experts=cpu"));
    }
}
